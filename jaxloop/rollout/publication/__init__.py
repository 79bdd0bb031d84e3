"""Policy publication, from the trainer's parameters to an engine's committed version:

- policy.py: a Policy as the HF-named tensors engines load (names from the family table).
- staging.py: HostStaging, the reused host buffers a publisher stages those tensors (and their
  hashes) through.
- transaction.py: the transaction itself (Manifest, safetensors buckets, PublicationReceiver;
  delta and xor payloads). numpy + ml_dtypes only: engine processes import it.

How a publication travels to Ray engine actors (object store or files) and the replay chain of
the committed version: jaxloop.rollout.ray.transport.

This package imports nothing at import time (engine processes import transaction.py alone).
"""
