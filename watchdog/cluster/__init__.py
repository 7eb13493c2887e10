"""Several nodes, one verdict: the sidecars of a job meet through the job's own rendezvous store."""
