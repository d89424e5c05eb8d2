"""Trainer: supervised warm-up (and later RL updates) for models served by the engine."""
