"""RL tasks: problem sources, prompts and reward functions."""
