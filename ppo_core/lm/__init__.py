"""Language-model plumbing: loading, rollout, log-probs, packing, masked statistics, checkpoints, data parallelism, tiny test models."""
