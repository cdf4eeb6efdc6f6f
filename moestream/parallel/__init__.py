"""Expert parallelism: which rank owns which experts, and (engine side) ranks that serve them."""
