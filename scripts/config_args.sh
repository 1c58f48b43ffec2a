# Sourced by run_llama_train.sh and scripts/multinode_trainer.slurm: which TOML file a launch trains.
#   config_args DEFAULT "$@"   sets CONFIG_ARGS to the arguments to put before "$@"
# The user's --job.config_file wins over CONFIG_FILE (upstream torchtitan's last-one-wins), with one line when
# both are given and differ; otherwise CONFIG_FILE, else DEFAULT. Two different --job.config_file arguments
# reach the config parser, which refuses them in one line (exit 2).
config_args() {
  local default=$1 cli_config="" prev="" arg
  shift
  for arg in "$@"; do
    case "$arg" in
      --job.config_file=* | --job.config-file=*) cli_config="${arg#*=}" ;;
    esac
    if [ "$prev" = "--job.config_file" ] || [ "$prev" = "--job.config-file" ]; then
      cli_config="$arg"
    fi
    prev="$arg"
  done
  CONFIG_ARGS=()
  if [ -z "$cli_config" ]; then
    CONFIG_ARGS=(--job.config_file "${CONFIG_FILE:-$default}")
  elif [ -n "${CONFIG_FILE:-}" ] && [ "$CONFIG_FILE" != "$cli_config" ]; then
    echo "note: training with --job.config_file $cli_config (it overrides CONFIG_FILE=$CONFIG_FILE)" >&2
  fi
}
