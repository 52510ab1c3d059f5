"""rlalign: reinforcement learning for language models, and the textbook RL it grew from.

Layers (imports point down only): core (pure maths) <- classic, lm <- train <- cli.
"""

__version__ = "0.1.0"
