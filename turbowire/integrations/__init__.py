"""turbowire.integrations: glue between turbowire's codec and other systems' extension points.

Each integration lives in its own module and imports its host system itself, so importing this
package pulls in nothing optional:

- ``turbowire.integrations.lmcache_serde``: the ``turbowire`` serde of LMCache's multi-process
  storage (L2 adapters); importing it registers the serde.
"""
