"""The edge's policy service: Envoy's ext_authz server that maps API keys to tiers.

``keys`` reads the keys file (hashed keys -> tier names), ``authz`` answers Envoy's Check calls,
``server`` is the process, and ``envoy_config`` renders ``envoy/envoy.yaml`` for a local stack.
"""
