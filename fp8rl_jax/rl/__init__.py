"""The RL math: group advantages, the clipped surrogate loss, importance-sampling correction, mismatch metrics."""
