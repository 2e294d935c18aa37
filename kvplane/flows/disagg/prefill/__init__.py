"""The prefill side of P/D: its side, admission of decode ranks, the held-request and push-target machines, pushes. Nothing imports between decode/ and prefill/."""
