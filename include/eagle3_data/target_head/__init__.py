"""The target model's head: its final norm, the log-probabilities of its lm head and their check
against the engine's.

The extraction, the export check and the probe compute the same figures: below the stages.
"""
