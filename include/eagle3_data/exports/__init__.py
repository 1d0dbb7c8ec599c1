"""The trainers' formats: the packed hidden-state shards, the speculators and ids exports, their
check through the trainers' own readers.

The extraction writes them, the probe and `check-export` read them: below the stages.
"""
