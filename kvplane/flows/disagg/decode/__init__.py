"""The decode side of P/D: its side, request and link machines, connections, starts and staged pulls. Nothing imports between decode/ and prefill/."""
