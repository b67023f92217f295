"""Who is an admin of the daemon: root, and the members of ``daemon.admin_group``.

An admin sees every run and may cancel any of them (`slurmft runs`, `status`, `cancel`); every
other user sees and acts on their own runs only. Membership is read from the system's group
database at each request (NSS: /etc/group, LDAP, SSSD), so a user added to or removed from the
group is an admin, or not, at their next request, without a daemon restart.
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass

ROOT_UID = 0


@dataclass(frozen=True)
class Admins:
    group: str = ""  # empty: root only

    def __contains__(self, uid: object) -> bool:
        if uid == ROOT_UID:
            return True
        if not self.group or not isinstance(uid, int):
            return False
        try:
            gid = grp.getgrnam(self.group).gr_gid
            user = pwd.getpwuid(uid)
        except KeyError:  # no such group (a typo is no one's privilege), or an unknown uid
            return False
        return gid in os.getgrouplist(user.pw_name, user.pw_gid)


ROOT_ONLY = Admins()
