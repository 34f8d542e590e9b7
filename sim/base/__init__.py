"""The ground floor: helpers that need nothing of batchsim (strict config
building and its errors, atomic writes, the C heap, provenance).

Rule: imports nothing of the project (the standard library, and PyYAML for
the strict loader)."""
