"""Hooks that observe and reduce; they never judge (that is rules/)."""
