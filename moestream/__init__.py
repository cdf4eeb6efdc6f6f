"""moestream: serve Mixture-of-Experts models whose experts live on SSD and in host RAM."""

__version__ = "0.1.0"
