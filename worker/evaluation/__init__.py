"""Search quality on the user's own judgments: ``sift eval``'s runs and measures
(:mod:`.harness`) and ``sift eval --tune``'s cross-validated fusion tuning (:mod:`.tuning`).

This file imports nothing.
"""
