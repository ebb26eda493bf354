"""reflow: RL post-training of LLMs as Prefect flows over a long-lived Ray cluster.

The product's layers are the subpackages reflow.flows, reflow.tasks, reflow.infra, reflow.engines
and reflow.rl (src/reflow/<layer>/ in the repository); imports point down only, in that order.
"""
