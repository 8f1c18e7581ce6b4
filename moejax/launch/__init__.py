"""Starting a run: process settings due before jax (`startup`), the model flags (`flags`), the
weights (`loading`) and the engines built of them (`factory`)."""
