"""The ground floor: contracts (types, errors, registry), models, data, metrics, LPIPS
weights, the defense-call helpers and the client's local-step unroll. Imports nothing of
this project above it."""
__version__ = "0.1.0"
