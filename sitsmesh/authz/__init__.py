"""ext_authz: identity, per-tenant model policy and admission for every request."""
