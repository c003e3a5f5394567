"""The experiment layer: the results store (and, as it grows, the config loader, sweep runner and
executors shared by every sweep)."""
