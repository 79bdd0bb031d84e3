"""The device mesh (`mesh`: axes, logical-axis rules for weights and activations, shardings of
the train state, batches and KV caches) and many-host start-up (`distributed`)."""
