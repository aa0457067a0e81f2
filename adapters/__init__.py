"""Framework adapters: each imports the core; the core never imports them."""
