"""The training glue: gradient buckets, the elastic sampler, the registered state and its
plain encoding, flash checkpoints, batch-size and learning-rate scaling."""
