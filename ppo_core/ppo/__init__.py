"""The PPO algorithm: config, trainer, its state, experience, losses, advantages, rewards, KL, value, metrics."""
