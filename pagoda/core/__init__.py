"""Scheduling and KV block bookkeeping: plain Python over integers, no torch."""
