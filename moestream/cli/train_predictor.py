"""`moestream train-predictor`: train a policy's learned predictor on a trace and save it to a directory.

The directory (weights.safetensors + predictor.json) is written under a temporary name beside --out
and renamed into place, so it is never seen half written. A policy loads it with
`POLICIES.create(KIND, topology, predictor_dir=DIR)` (fit() then keeps it) or `policy.load(DIR)`.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moestream.atomic import make_readable, staging_dir
from moestream.errors import MoestreamError
from moestream.policies import POLICIES
from moestream.policies.trained import TrainedPolicy
from moestream.predictors.configs import TrainConfig
from moestream.settings import add_arguments, from_args, same_as, setting

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class TrainFlags:
    """train-predictor's settings: TrainConfig's (its defaults, these flags), the held-out split, the output."""

    num_epochs: int = same_as(TrainConfig, "num_epochs", help="training epochs", flag="--epochs")
    seed: int = same_as(TrainConfig, "seed", help="seed of initialisation and shuffling")
    batch_size: int = same_as(TrainConfig, "batch_size", help="tokens per minibatch")
    learning_rate: float = same_as(TrainConfig, "learning_rate", help="AdamW learning rate", flag="--lr")
    num_threads: int = same_as(TrainConfig, "num_threads", help="torch threads while training", flag="--threads")
    holdout: float = setting(0.0, "fraction of sequences held out (seeded split) and evaluated, not trained on")
    split_seed: int = setting(0, "seed of the --holdout split")
    force: bool = setting(False, "replace an existing --out directory")
    no_progress: bool = setting(False, "no progress bar")  # the command shows one (a TrainConfig made in Python not)

    def train_config(self) -> TrainConfig:
        names = ("num_epochs", "seed", "batch_size", "learning_rate", "num_threads")
        return TrainConfig(progress=not self.no_progress, **{name: getattr(self, name) for name in names})


def trainable_kinds() -> list[str]:
    return [name for name in POLICIES.names() if issubclass(POLICIES.get(name), TrainedPolicy)]


def add_parser(commands) -> None:
    parser = commands.add_parser("train-predictor", help="train a policy's predictor on a trace and save it")
    parser.add_argument("--kind", required=True, metavar="NAME",
                        help=f"the policy whose predictor to train: {', '.join(trainable_kinds())}")
    parser.add_argument("--trace", required=True, type=Path, help="routing trace (.npz)")
    parser.add_argument("--tokens", type=Path, help="tokens jsonl of a DeepSeek routing npz")
    parser.add_argument("--out", required=True, type=Path, help="directory to write the trained predictor to")
    add_arguments(parser, TrainFlags, only=("num_epochs", "seed", "batch_size", "learning_rate", "num_threads"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a field of the design's config (e.g. window_tokens=8, num_distances=2); repeatable")
    add_arguments(parser, TrainFlags, skip=("num_epochs", "seed", "batch_size", "learning_rate", "num_threads"))
    parser.set_defaults(handler=run)


def run(args) -> int:
    from moestream.trace.format import load_trace

    cls = POLICIES.get(args.kind)
    if not issubclass(cls, TrainedPolicy):
        raise MoestreamError(f"policy {args.kind!r} learns no predictor; trainable: {', '.join(trainable_kinds())}")
    _check_out(args.out, args.force)
    if not 0.0 <= args.holdout < 1.0:
        raise MoestreamError(f"--holdout must be in [0, 1), got {args.holdout}")
    config = parse_overrides(cls.config_class(), args.set)
    trace = load_trace(args.trace, args.tokens)
    train_trace, test_trace = trace.split(args.holdout, args.split_seed) if args.holdout else (trace, None)
    policy = cls(trace.topology, config=config, train=from_args(TrainFlags, args).train_config())
    start = time.perf_counter()
    policy.fit(train_trace)
    seconds = time.perf_counter() - start
    _save(policy, args.out)
    sequences = len(train_trace.sequence_ids())
    print(f"trained {policy.predictor.kind} for {args.kind} on {train_trace.num_tokens} tokens ({sequences} "
          f"sequences) in {seconds:.1f} s; final loss {policy.predictor.losses[-1]:.4f}")
    if test_trace is not None:
        for name, value in policy.predictor.evaluate(test_trace).items():
            print(f"held-out {name}: {value:.4f}  ({test_trace.num_tokens} tokens)")
    print(f"saved to {args.out}")
    return 0


def parse_overrides(config, items: list[str]):
    """config with KEY=VALUE items applied, each converted to the type of the field's current value."""
    known = {f.name: type(getattr(config, f.name)) for f in dataclasses.fields(config)}
    values = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in known:
            raise MoestreamError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(known))}")
        values[key] = _convert(key, text, known[key])
    return dataclasses.replace(config, **values)


def _convert(key: str, text: str, kind: type):
    if kind is bool:
        if text.lower() not in TRUE + FALSE:
            raise MoestreamError(f"--set {key}={text}: expected true or false")
        return text.lower() in TRUE
    try:
        return kind(text)
    except ValueError:
        raise MoestreamError(f"--set {key}={text}: expected a {kind.__name__}") from None


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise MoestreamError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise MoestreamError(f"--out {out} exists and is not empty; pass --force to replace it")
    if not out.parent.is_dir():
        raise MoestreamError(f"--out {out}: parent directory {out.parent} does not exist")


def _save(policy: TrainedPolicy, out: Path) -> None:
    """Saves into a fresh directory beside out, then swaps it into place."""
    staging = staging_dir(out, "new")
    try:
        policy.save(staging)
        make_readable(staging)
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old."))
            out.rename(old / out.name)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
