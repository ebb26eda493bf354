"""reflow: RL post-training of LLMs as Prefect flows over a long-lived Ray cluster.

The repository keeps the product's layers as top-level folders (flows/, tasks/, infra/, engines/,
rl/); installed, they are the subpackages reflow.flows, reflow.tasks, reflow.infra, reflow.engines
and reflow.rl (pyproject.toml maps each folder into this package), so nothing generic such as
`tasks` or `engines` lands at the top level of site-packages.
"""
