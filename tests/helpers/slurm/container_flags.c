/* Test cluster only (tests/helpers/slurm_cluster.py): a SPANK plugin that accepts pyxis's
 * container options, so `nutp sbatch` scripts run as rendered on a Slurm without pyxis. The
 * tasks run on the host; --container-workdir is honoured (the task starts there), the image,
 * mounts and --no-container-mount-home are accepted and have no effect. */
#include <slurm/spank.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

SPANK_PLUGIN(nutp_container_flags, 1);

static char workdir[4096];

static int accept_value(int val, const char *optarg, int remote) {
    (void)val; (void)optarg; (void)remote;
    return 0;
}

static int set_workdir(int val, const char *optarg, int remote) {
    (void)val; (void)remote;
    if (optarg == NULL || strlen(optarg) >= sizeof(workdir)) return -1;
    strcpy(workdir, optarg);
    return 0;
}

struct spank_option spank_options[] = {
    {"container-image", "IMAGE", "accepted (test cluster: no container)", 1, 0, accept_value},
    {"container-mounts", "MOUNTS", "accepted (test cluster: no container)", 1, 0, accept_value},
    {"container-workdir", "DIR", "the task's working directory", 1, 0, set_workdir},
    {"no-container-mount-home", NULL, "accepted (test cluster: no container)", 0, 0,
     accept_value},
    SPANK_OPTIONS_TABLE_END
};

int slurm_spank_task_init(spank_t sp, int ac, char **av) {
    (void)sp; (void)ac; (void)av;
    if (workdir[0] != '\0' && chdir(workdir) != 0) {
        slurm_error("nutp_container_flags: cannot chdir to %s", workdir);
        return -1;
    }
    return 0;
}
