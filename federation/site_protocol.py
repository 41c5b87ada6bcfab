"""The site-link protocol version, which agents and coordinators announce in Hello and Welcome.

History:

1. Before the version fields: such agents send 0 in ``Hello.protocol_version``, read as 1.
2. ``Hello`` carries ``agent_version`` and ``protocol_version``; ``Welcome`` answers with
   ``coordinator_version`` and the version the coordinator speaks to the agent.
3. ``ChangeTask`` and its ``ChangeAnswer``: a running service scaled or updated in place. Sent
   only to agents that speak 3; a change for a site whose agent speaks 2 is refused, naming it.
4. Data between sites: ``TaskSpec.outputs`` reported as ``TaskReport.artifacts``, the
   ``StagedInput`` list of a ``Commit``, and ``PresignRequest`` answered by ``PresignAnswer``.
   A task with outputs or staged inputs is offered only to agents that speak 4, and only they
   are asked to sign.
5. Checkpoints between sites: ``CheckpointRecord.stored``, ``Commit.restore``, PUT URLs
   (``PresignRequest.method`` "PUT") and ``ReplicateCheckpoint`` answered by
   ``ReplicateAnswer``. Only agents that speak 5 are sent them; an older site's task restores
   from the path its checkpoint was written at, as before.
6. Logs, datasets and measured stage-ins: ``ReadLogs`` answered by ``LogsAnswer``, a
   replica's output lines as its site keeps them (for an older site's task ``StreamLogs`` says
   to upgrade its agent); ``DescribeRequest`` answered by ``DescribeAnswer``, the size and
   SHA-256 of an object of the site's store, for a dataset being registered; and
   ``StageProgress`` from the agent (an input's progress while it downloads, its bytes and
   seconds once in place) with ``StagedInput.site``. Sent only to, and by, sides that speak 6.

Each release speaks its own version and at least the one before (this one speaks 1 to 6), so
an agent and a coordinator one version apart always share one: the coordinator answers with
the older of the two. Further apart, the agent is refused with the side to upgrade
(coordinators first, then agents, keeps every pair within one). An agent ignores a coordinator
message whose body it does not know (it logs ``unknown_message_ignored``), so a message added
in a later version must be one an older agent may ignore without harm, or be sent only to
agents that speak it. Every message of version 2 is understood by version 1 agents, or needs
no answer (the trust bundle after a CA rollover: such an agent keeps its CA bundle until it is
given a new one); version 3's ChangeTask goes only to agents that speak 3, version 4's data
messages only to agents that speak 4, version 5's checkpoint messages only to agents that
speak 5, version 6's log reads and describe requests only to agents that speak 6.
"""

from __future__ import annotations

from federation.errors import ProtocolVersionError

PROTOCOL_VERSION = 6
"""The site-link protocol this release speaks."""
STAGE_PROGRESS_PROTOCOL = 6
"""The first that carries ``StageProgress``."""
MIN_PROTOCOL_VERSION = 1
"""The oldest an agent may speak and still be served."""


def agreed_version(announced: int) -> int:
    """The version a coordinator speaks to an agent that announced ``announced`` (0: an agent
    from before the field, version 1): the older of the two.

    Raises:
        ProtocolVersionError: The agent is too old, or more than one version newer.
    """
    version = announced or 1
    if version < MIN_PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"the agent speaks site-link protocol {version}, older than {MIN_PROTOCOL_VERSION}, "
            f"the oldest this coordinator (protocol {PROTOCOL_VERSION}) speaks. To fix: "
            "upgrade the agent",
            agent=str(version),
            coordinator=str(PROTOCOL_VERSION),
        )
    if version > PROTOCOL_VERSION + 1:
        raise ProtocolVersionError(
            f"the agent speaks site-link protocol {version}, more than one newer than "
            f"{PROTOCOL_VERSION} that this coordinator speaks. To fix: upgrade the coordinator "
            "(coordinators first, then agents)",
            agent=str(version),
            coordinator=str(PROTOCOL_VERSION),
        )
    return min(version, PROTOCOL_VERSION)
