import sys

import moestream

if getattr(moestream, "__file__", None) is None:  # a folder named moestream (a clone) shadows the package
    shadow = ", ".join(getattr(moestream, "__path__", [])) or "moestream"
    print(f"moestream: error: the folder {shadow} shadows the installed package: run `python -m moestream` "
          "from another folder (or the `moestream` command)", file=sys.stderr)
    sys.exit(2)

from moestream.cli import main  # noqa: E402  (after the check: it needs the real package)

sys.exit(main())
