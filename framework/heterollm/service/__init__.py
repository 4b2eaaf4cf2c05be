"""Service discovery (an instance registers with etcd or an HTTP service layer) and the router that
spreads OpenAI requests over the registered instances (`heterollm route`)."""
