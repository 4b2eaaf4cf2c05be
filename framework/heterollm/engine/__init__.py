"""Requests, the step loop and the offline LLM API."""
