"""The delivery core: a delivery and its fence, the claim, the lease and its keeper, the outcome writer, maintenance."""
