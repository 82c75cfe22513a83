"""The gateway's version (`/version`, OpenAPI, `system_fingerprint`)."""

VERSION = "0.1.0"
