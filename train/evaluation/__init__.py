"""`pisa-eval`: perplexity, RULER needle-in-a-haystack, MQAR and the block-selection diagnostic."""
