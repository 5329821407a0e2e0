"""The control plane: KV events (events), the residency indexer (indexer), the router
(router), the router modules a node hosts (modules, host) and the shared data model (model)."""
