"""Trainer: recorded calls into samples, the RL algorithms, the training engine and loop, and the
supervised warm-up, for models served by the engine."""
