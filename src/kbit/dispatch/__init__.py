"""The layer that chooses kernels: for every call it decides which backend of ``kbit.ops`` runs (and what runs where
one is not available). Dense linear: :mod:`kbit.dispatch.linear`."""
