"""moejax: a pure-JAX reference runtime for large Mixture-of-Experts models."""
