"""The lab's own commands (`moestream sim`, `predict-eval`, `loadgen`): measurement the product never
imports; each module adds its command through add_parser(), and `moestream.cli` names it."""
