"""IGNORE: the label of a position that is not trained (prompts, padding, a packed row's boundaries).

-100 is the ignore_index of torch's cross_entropy and of transformers' losses, so a label row can be handed to
either as it is. Every module that writes or reads labels takes it from here (one copy of the convention).
"""

IGNORE = -100
