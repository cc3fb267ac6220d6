"""Evaluation: KL to the reference, proxy and gold reward, statistics, report, markdown, plots."""
