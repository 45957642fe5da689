"""The routes, one module per noun, each a `router(...)` over the one service of its noun
(`e31.api.services`): a handler parses the request, calls one service method and shapes the
answer. `e31.api.app.create_app` includes them in the order the OpenAPI document lists them.
"""
