"""The OpenAI Responses API (`/v1/responses`): its request schema, the translation onto the
chat path, the typed SSE events, the stored responses and the routes."""
