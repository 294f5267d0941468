"""What the aggregator keeps: the model's fragments and which this shard owns (params), each
fragment's parameters, outer state, update log and pull answers (fragment), and the durable
state dir (store)."""
