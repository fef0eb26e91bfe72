"""Anthropic's Messages API (`/v1/messages`), served beside the OpenAI routes."""
