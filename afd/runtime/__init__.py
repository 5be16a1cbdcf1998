"""The processes of a run: the engine-core process of a monolithic server, and the ranks of a disaggregated
run with the launcher, supervisor, rebalancer and multi-node links that start, watch and heal them. One
owner thread per run changes its state (cluster.py); the serving front end reaches the engines through a
replica client (clients.py). The runtime never imports afd.serving."""
