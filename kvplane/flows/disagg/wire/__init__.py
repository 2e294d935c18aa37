"""What both sides of P/D share: config, messages and the side channel, authentication, params, the I/O loop, the mover and local KV. Nothing imports between decode/ and prefill/."""
