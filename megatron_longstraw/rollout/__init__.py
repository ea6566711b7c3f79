"""Responses from a captured prompt: decoding (`decode`), reward plug-ins (`rewards`) and the
online loop's rollout of a group (`online`). Imports: every wing below."""
