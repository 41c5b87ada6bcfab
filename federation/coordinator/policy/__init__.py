"""Sharing the federation: queues with quotas, fair share between them, priority classes.

Each piece is a small pure function or table a test can read in one screen:
``resources.demand`` (what a task holds), ``quota.admission`` (may it start now),
``fair_share.dominant_share`` and ``fair_share.fair_order`` (who goes first), and
``priority.parse_priority_classes``; ``queues.QueueBook`` keeps the queues in the store and
``usage.QueueUsage`` what each queue's tasks hold now.
"""
