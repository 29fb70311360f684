"""Global rate limiting: envoyproxy/ratelimit's config format and answers, and more."""
