"""Fellows on many machines from one command: hostfiles, and ``swarm launch`` over ssh.

``hostfile`` parses the list of hosts, ``launcher`` runs one ssh session per host, ``remote``
is what that session runs on the far end (it starts and stops the fellows there).
"""
